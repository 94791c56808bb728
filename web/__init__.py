"""tokenrelay's web package."""
