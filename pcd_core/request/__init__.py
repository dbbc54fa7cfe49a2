"""What a caller asks: a schema of closed and open fields, question sets, a conversation, and the limits a request must keep."""
