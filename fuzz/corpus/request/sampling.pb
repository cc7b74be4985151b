
Blessed are they that	session-1"'млL?(%fff?-млL=5мл▄?8B
BAmenHP