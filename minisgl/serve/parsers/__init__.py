"""Reading a model's answer: tool calls and reasoning in its text (streamed or whole), and the
OpenAI chat message they make. Used by the API routes and the tokenizer's chat templates."""
