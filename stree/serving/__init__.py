"""Serving many requests: the continuous-batching engine over state slots (:mod:`.engine`) and
the OpenAI-compatible HTTP server on it (:mod:`.server`)."""

from .engine import Choice, Engine, EngineClosed, Event, Overloaded, Request

__all__ = ["Choice", "Engine", "EngineClosed", "Event", "Overloaded", "Request"]
