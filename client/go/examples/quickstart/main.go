// Quickstart: announce a worker, place a prompt on it, and ask kvix which worker can
// reuse the follow-up. Run it beside a server: go run ./examples/quickstart [ADDR].
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	kvix "github.com/kvix/kvix/client/go"
	"github.com/kvix/kvix/client/go/wire"
)

func main() {
	cfg := kvix.DefaultConfig() // 127.0.0.1:7420, 16-token blocks, 2 ms deadline
	if len(os.Args) > 1 {
		cfg.Servers = os.Args[1:]
	}
	client, err := kvix.Connect(cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := client.WaitConnected(ctx); err != nil {
		log.Fatalf("no kvix-server at %v: %v", cfg.Servers, err)
	}
	feed := wire.Feed{Kind: wire.FeedPlacements, CapacityBlocks: 1_000_000}
	if _, err := client.Announce(ctx, "worker-0", []wire.Lane{wire.FullLane(16)}, feed); err != nil {
		log.Fatal(err)
	}
	ks := wire.TokensKeyspace("llama-3-8b")
	prompt := make([]uint32, 4096) // a prompt's token ids, routed to worker-0
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	client.PublishPlacement("worker-0", ks, client.TokenChain(ks, prompt))
	followUp := append(prompt, 5000, 5001, 5002) // the next turn of that conversation
	for {
		// Queries never fail: a Reason other than ReasonScores means "route without kvix".
		o := client.QueryTokens(ctx, ks, followUp, kvix.QueryOptions{})
		if best, ok := o.Best(); ok {
			fmt.Println(best.Name, best.Blocks, "blocks reusable")
			return
		}
		if ctx.Err() != nil {
			log.Fatalf("no answer: %v", o.Reason)
		}
		time.Sleep(10 * time.Millisecond) // placements are fire-and-forget
	}
}
