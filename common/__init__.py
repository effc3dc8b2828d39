"""What two or more processes share: message types, the wire codec, sampling parameters, configuration."""
