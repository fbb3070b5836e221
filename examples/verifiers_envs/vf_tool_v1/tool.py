"""The `calc` MCP tool server of `vf_tool_v1` (verifiers runs it as `python -m vf_tool_v1.tool`)."""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"  # the model sees the tool as "calc_add"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers and return the sum."""
        return str(a + b)


if __name__ == "__main__":
    AddToolset.run()
