"""Django integration for advisory-locks.

Placeholder: the Django app (settings, manager and queryset, ``atomic()`` integration,
signals, checks and the management command) arrives with its own issue. Until then this
package is empty and, like the core, imports nothing from Django.
"""
