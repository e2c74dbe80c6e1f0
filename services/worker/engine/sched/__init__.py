"""The engine scheduler: which requests run this step and how many tokens each."""
