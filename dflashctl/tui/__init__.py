"""The status screen: ``app``, ``widgets``, ``screens``, ``text``, ``charts`` and
``actions`` draw the view models of ``dflashctl.status.model`` (pure, read from the
store, never importing UI code) with Textual."""
