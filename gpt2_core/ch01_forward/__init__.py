"""Chapter 1, the naive forward: every layer of GPT-2 as a plain NumPy function (``model``), choosing the next token
(``sampling``), and a loop that runs the whole sequence again for every new token (``generation``)."""
