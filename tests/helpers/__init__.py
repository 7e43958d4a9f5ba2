"""Shared test helpers: process runners, a small model and a recording callback."""
