"""Training drafters on a frozen target (optax)."""
