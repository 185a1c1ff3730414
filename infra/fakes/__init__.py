"""Local fakes of cloud services for development and tests (no network, no credentials)."""
