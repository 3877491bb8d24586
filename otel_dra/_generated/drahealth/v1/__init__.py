"""Generated from proto/ by `make protos`; do not edit."""
