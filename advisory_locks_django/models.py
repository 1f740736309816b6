"""No model is defined here.

The admin page's table-less ``DatabaseLock`` is defined in ``admin.py`` (which says why).
This module exists because Django creates the permissions and content types of an app's
models only for an app that has a ``models`` module.
"""
