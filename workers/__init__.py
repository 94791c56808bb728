"""tokenrelay's workers package."""
