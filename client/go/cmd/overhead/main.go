// Command overhead measures what a query costs from the Go client against the Rust
// client's blocking call: same server, same prompts, interleaved rounds so that the
// noise of a shared machine falls on both alike. It loads the server, starts the Rust
// side (client/examples/blocking_rounds.rs) and prints p50 / p99 of each and their
// ratio. scripts/go-overhead.sh builds everything and runs it.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	kvix "github.com/kvix/kvix/client/go"
	"github.com/kvix/kvix/client/go/wire"
)

// prompt is worker w's prompt, as the Rust side derives it.
func prompt(w, blocks uint32) []uint32 {
	out := make([]uint32, blocks*16)
	for i := range out {
		out[i] = (w*1_000_003 + uint32(i)*7919) % (1 << 17)
	}
	return out
}

func main() {
	server := flag.String("server", "127.0.0.1:7420", "kvix-server address")
	rust := flag.String("rust", "", "the blocking_rounds binary")
	blocks := flag.Uint("blocks", 125, "prompt length in 16-token blocks")
	workers := flag.Uint("workers", 16, "workers, one prompt each")
	rounds := flag.Int("rounds", 40, "rounds, each of both sides")
	per := flag.Int("per-round", 200, "queries per side per round")
	flag.Parse()

	cfg := kvix.DefaultConfig()
	cfg.Servers = []string{*server}
	cfg.Name = "overhead-go"
	cfg.Deadline = 50 * time.Millisecond
	c, err := kvix.Connect(cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.WaitConnected(ctx); err != nil {
		log.Fatal(err)
	}
	ks := wire.TokensKeyspace("overhead-bench")
	prompts := make([][]uint32, *workers)
	for w := range prompts {
		name := fmt.Sprintf("bench-worker-%d", w)
		feed := wire.Feed{Kind: wire.FeedPlacements, CapacityBlocks: 1 << 20}
		if _, err := c.Announce(ctx, name, []wire.Lane{wire.FullLane(16)}, feed); err != nil {
			log.Fatal(err)
		}
		prompts[w] = prompt(uint32(w), uint32(*blocks))
		c.PublishPlacement(name, ks, c.TokenChain(ks, prompts[w]))
	}
	for w := range prompts {
		for c.QueryTokens(ctx, ks, prompts[w], kvix.QueryOptions{}).Reason != kvix.ReasonScores {
			if ctx.Err() != nil {
				log.Fatal("the placements were never answered")
			}
			time.Sleep(time.Millisecond)
		}
	}

	cmd := exec.Command(*rust, *server, strconv.Itoa(int(*blocks)), strconv.Itoa(int(*workers)))
	cmd.Stderr = os.Stderr
	in, _ := cmd.StdinPipe()
	outPipe, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		log.Fatalf("the Rust side (%s): %v", *rust, err)
	}
	out := bufio.NewScanner(outPipe)
	out.Buffer(nil, 1<<24)
	var goNs, rustNs []float64
	i := 0
	for r := 0; r < *rounds+1; r++ {
		var g []float64
		for k := 0; k < *per; k++ {
			p := prompts[i%len(prompts)]
			i++
			t := time.Now()
			o := c.QueryTokens(context.Background(), ks, p, kvix.QueryOptions{})
			took := time.Since(t)
			if o.Reason != kvix.ReasonScores {
				log.Fatalf("a Go query: %v", o.Reason)
			}
			g = append(g, float64(took.Nanoseconds()))
		}
		fmt.Fprintln(in, *per)
		if !out.Scan() {
			log.Fatal("the Rust side stopped")
		}
		var rs []float64
		for _, f := range strings.Fields(out.Text()) {
			v, _ := strconv.ParseFloat(f, 64)
			rs = append(rs, v)
		}
		if r > 0 { // round 0 warms both up
			goNs, rustNs = append(goNs, g...), append(rustNs, rs...)
		}
	}
	in.Close()
	_ = cmd.Wait()
	q := func(xs []float64, p float64) float64 {
		s := slices.Clone(xs)
		slices.Sort(s)
		return s[min(len(s)-1, int(p*float64(len(s))))] / 1000
	}
	fmt.Printf("%d-block prompts, %d queries each, GOMAXPROCS=%s\n", *blocks, len(goNs), os.Getenv("GOMAXPROCS"))
	fmt.Printf("go   p50 %.1f us  p99 %.1f us\n", q(goNs, 0.5), q(goNs, 0.99))
	fmt.Printf("rust p50 %.1f us  p99 %.1f us\n", q(rustNs, 0.5), q(rustNs, 0.99))
	fmt.Printf("go / rust: p50 %.2fx  p99 %.2fx\n", q(goNs, 0.5)/q(rustNs, 0.5), q(goNs, 0.99)/q(rustNs, 0.99))
}
