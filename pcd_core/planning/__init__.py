"""Which reads to make and in what order: the planner, the fill and decide plans, batching many inputs, and the caches they share."""
