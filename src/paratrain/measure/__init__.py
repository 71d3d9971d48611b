"""What the bench and the planner both measure with: the workloads (a model, batches and loss by name, the GPT
decoder among them) and the one timing harness. Neither `bench` nor `planner` imports the other."""
