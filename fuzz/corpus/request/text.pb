
And God said*req-1