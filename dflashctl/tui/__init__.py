"""The status screen. ``model`` holds the view models (pure, read from the store,
never imports UI code); ``widgets`` and ``app`` draw them with Textual."""
