"""The learning tier (tier.py): every recipe proves that it learns."""
