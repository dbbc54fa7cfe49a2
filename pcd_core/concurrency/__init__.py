"""Sharing one model between callers: the model lock with its cancellation, and the join that merges waiting callers' passes."""
