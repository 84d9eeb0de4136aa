"""Agentic RL: the user's agent talks to an OpenAI-compatible proxy that records every call's exact
tokens (docs/agents.md). `session` is the record, `proxy` the server; the episode is
`tandem.rollout.workflows.agent`."""
