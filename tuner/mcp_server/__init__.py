"""`moe-tune mcp`: an MCP server (stdio) that lets an agent ask what fits, which quants a repo holds, what was tuned
here and the line to launch, without measuring anything. A second thin front end beside :mod:`tuner.cli`, over
the same library calls (:mod:`tuner.mcp_server.answers`); the protocol is the official MCP Python SDK's."""
