"""An OpenAI-compatible HTTP front (FastAPI): /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics, translated onto a tandem router through the client library. It imports
only tandem.client and tandem.common, never the engine."""
