"""Multi-turn environments with tools (docs/design.md §15): the Environment protocol (base), the
name table and entry points (registry), tool-call parsing (tool_calls), tools (tools), the
tool-environment base (tool_env), the built-ins (builtin) and the chat-template rendering of
episodes (render). JAX-free; importing the package registers the built-ins. ``EnvironmentSpec``
lives in the configuration (rlax_tasks.config.environment), below this package."""

from rlax_tasks.environments.base import (
    Environment,
    EnvironmentSpec,
    StepResult,
    check_environment,
)
from rlax_tasks.environments.builtin import (
    CalculatorEnvironment,
    CodeEnvironment,
    PythonEnvironment,
)
from rlax_tasks.environments.registry import (
    ENTRY_POINT_GROUP,
    environment_names,
    make_environment,
    register,
)
from rlax_tasks.environments.render import ChatRenderer, truncate_observation
from rlax_tasks.environments.tool_calls import (
    STYLES,
    ParsedTurn,
    ToolCall,
    format_tool_call,
    parse_tool_calls,
)
from rlax_tasks.environments.tool_env import ToolEnvironment
from rlax_tasks.environments.tools import Calculator, PythonTool, Tool, ToolOutput, run_tool

__all__ = [
    "ENTRY_POINT_GROUP",
    "STYLES",
    "Calculator",
    "CalculatorEnvironment",
    "ChatRenderer",
    "CodeEnvironment",
    "Environment",
    "EnvironmentSpec",
    "ParsedTurn",
    "PythonEnvironment",
    "PythonTool",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolOutput",
    "check_environment",
    "environment_names",
    "format_tool_call",
    "make_environment",
    "parse_tool_calls",
    "register",
    "run_tool",
    "truncate_observation",
]
