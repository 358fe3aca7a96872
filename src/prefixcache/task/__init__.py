"""The task: its file, example selection, the prompt and its checked token boundary, the context policy."""
