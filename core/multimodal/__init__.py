"""Images and video frames in requests: what a request carries, how a step passes them to the model."""
