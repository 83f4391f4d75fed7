"""What travels between the two sides: messages, frame plans, socket setup, CURVE keys."""
