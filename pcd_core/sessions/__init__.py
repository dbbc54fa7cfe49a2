"""Conversations read as they grow: a session keeps the KV of what it has read, reads only what is appended,
and fires triggers when a decision changes.
"""
