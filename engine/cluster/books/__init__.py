"""The cluster member's books: the requests that cross nodes (`requests`) and the incarnation each other
node is known under (`incarnations`). Each has one owner, the member, and one writer, its class; the
member's parts (frames, commands) reach them through their methods only."""
