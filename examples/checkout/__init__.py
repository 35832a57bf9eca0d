"""The checkout example: a payment service whose Charge runs once per idempotency key."""
