"""Callbacks for the trainers people already use. Each module imports its library, so
``import gradmon`` never does: ``from gradmon.integrations.lightning import GradmonCallback``."""
