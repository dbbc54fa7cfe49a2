"""From a model name to a backend: load options, model files and their registry, the backend dispatch, dummy weights and shapes."""
