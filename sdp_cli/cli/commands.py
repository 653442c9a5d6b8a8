"""Imports every command module so that it registers itself on the root app."""
