"""`burstrl run`: start every role of an RL job, supervise them, show progress, tear all down."""
