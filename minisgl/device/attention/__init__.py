"""Attention backends behind one interface (``base.py``); ``select.create_backend`` picks one."""
