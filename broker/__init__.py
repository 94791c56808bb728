"""tokenrelay's broker package."""
