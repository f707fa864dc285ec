"""The three wire formats agents speak, one module each, and lookup by request path."""

from .base import AssistantTurn, ToolCall, ToolSpec, Usage, WireFormat, sse
from .chat import CHAT
from .messages import MESSAGES
from .responses import RESPONSES

ALL: tuple[WireFormat, ...] = (CHAT, MESSAGES, RESPONSES)
BY_NAME: dict[str, WireFormat] = {f.name: f for f in ALL}
BY_PATH: dict[str, WireFormat] = {f.path: f for f in ALL}

__all__ = ["ALL", "BY_NAME", "BY_PATH", "CHAT", "MESSAGES", "RESPONSES", "AssistantTurn", "ToolCall", "ToolSpec",
           "Usage", "WireFormat", "sse"]
