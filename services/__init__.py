"""Baton's services: gateway, global scheduler, workers."""
