"""The agent loop: model providers, tools and the turn loop."""
