"""The model-output parsers a server can be started with (launch.py's --tool-call-parser and --reasoning-parser;
frontend/tool_calls.py and frontend/reasoning.py read them). Apart, so the launcher names them without importing
the HTTP stack."""

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
REASONING_PARSERS = ("deepseek_r1",)
