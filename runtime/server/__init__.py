"""`onepass serve`: the TypeSafe System One HTTP endpoint and the MCP tool server (extra ``[serve]``)."""
