"""Tools for developing modelpatch itself, run from a source checkout (not needed to use the package).

``release``  ``python -m modelpatch.dev.release VERSION``: check a Transformers release (build its venv from or into
             ``constraints/``, regenerate the per-release support tables, run the suite, summarize what changed
             upstream in the Transformers files modelpatch depends on) and write ``docs/releases/X.Y.md``
"""
