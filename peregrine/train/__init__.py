"""Training the tiny Kimi-Linear model on checkable tasks: tasks, differentiable forward, train loop."""
