"""``vitrain forecast``: what N devices will give, from measured figures (see docs/forecast.md)."""
