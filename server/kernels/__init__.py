"""Device fast paths and their pure-torch reference twins. Imports torch only."""
