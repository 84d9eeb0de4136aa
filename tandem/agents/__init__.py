"""Built-in agents for `rollout.workflow: agent`: user-level code that talks to the policy only
through an `openai.AsyncOpenAI` client, `async def run(client, item) -> float`.

- `tandem.agents.calculator:run`: solves the `calculator` task's problems with its calculator tool.
"""
