// Package kvix is the pure-Go client of kvix, the shared prefix-cache index: what a Go
// gateway links to ask which worker already holds the longest reusable prefix of a
// prompt, inside a deadline. It speaks protocol version 5 (package wire) and keeps the
// Rust client's contract:
//
//   - Queries never fail and never wait past their deadline: they return an Outcome
//     whose Reason says whether to route without the index (fail open).
//   - One pipelined connection per configured server, kept up in the background with
//     exponential backoff; each (re)connect re-announces the workers this client owns
//     before anything else is sent on it.
//   - Workers are named by name; ids are learnt per server from announces and the
//     server's roster, whichever client announced them.
//   - Placements and reuse reports are fire-and-forget through bounded queues: full
//     means dropped and counted.
//
// A Client is safe for concurrent use by many goroutines.
package kvix

import (
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvix/kvix/client/go/wire"
)

// Config says how a Client connects and waits. DefaultConfig gives the documented
// defaults; Validate says what is wrong with a Config.
type Config struct {
	// Servers, in order of preference: "host:port" or "unix:/path". Queries go to the
	// first one up (hedged to the next, see HedgeAfter); writes go to every one up, or
	// to the first one up when Replicas.
	Servers []string
	// TokenBlock is the block size this client hashes with; the server refuses a
	// mismatch at handshake. Default 16.
	TokenBlock uint32
	// Auth is the shared token sent in Hello, when the server requires one.
	Auth string
	// Name names this client in the server's logs. Default "kvix-go".
	Name string
	// Deadline bounds a query in all. Default 2 ms.
	Deadline time.Duration
	// ReconnectMin and ReconnectMax bound the exponential reconnect delay. Default
	// 10 ms and 1 s.
	ReconnectMin, ReconnectMax time.Duration
	// Queue is the most placements (and, apart, reuse reports) waiting to be sent;
	// past it new ones are dropped and counted. Default 4096.
	Queue int
	// ConnectTimeout bounds one connection attempt (dial, handshake, re-announces).
	// Default 1 s.
	ConnectTimeout time.Duration
	// RequestTimeout bounds control requests (announce, retire, stats, echo) that
	// carry no context deadline. Default 1 s.
	RequestTimeout time.Duration
	// MaxFrame is the largest reply frame accepted. Default wire.DefaultMaxFrame.
	MaxFrame uint32
	// Replicas: the servers share one write log (kvix-server --log); writes go to the
	// first one up only and ids are the same on all.
	Replicas bool
	// HedgeAfter: with two servers or more up, a query the first has not answered
	// after this long also goes to the next, and the first answer wins. Default: a
	// quarter of the deadline; negative: never hedge.
	HedgeAfter time.Duration
	// TLS, when set, is used for TCP servers (kvix-server --tls-cert).
	TLS *tls.Config
	// Weights rank answers and weigh each score's Reuse, for queries that do not say.
	// Default wire.WeightsDynamo.
	Weights wire.TierWeights
}

// DefaultConfig is one server at 127.0.0.1:7420 with the defaults above.
func DefaultConfig() Config {
	return Config{
		Servers:        []string{"127.0.0.1:7420"},
		TokenBlock:     16,
		Name:           "kvix-go",
		Deadline:       2 * time.Millisecond,
		ReconnectMin:   10 * time.Millisecond,
		ReconnectMax:   time.Second,
		Queue:          4096,
		ConnectTimeout: time.Second,
		RequestTimeout: time.Second,
		MaxFrame:       wire.DefaultMaxFrame,
		Weights:        wire.WeightsDynamo,
	}
}

// ErrConfig is wrapped by every error Validate returns.
var ErrConfig = errors.New("kvix: invalid config")

// Validate says what is wrong with c, naming the field.
func (c Config) Validate() error {
	bad := func(field, why string) error { return fmt.Errorf("%w: %s %s", ErrConfig, field, why) }
	switch {
	case len(c.Servers) == 0:
		return bad("Servers", "is empty")
	case c.TokenBlock == 0:
		return bad("TokenBlock", "is 0")
	case c.Deadline <= 0:
		return bad("Deadline", "is not positive")
	case c.ReconnectMin <= 0 || c.ReconnectMax < c.ReconnectMin:
		return bad("ReconnectMin/ReconnectMax", "must be positive and ordered")
	case c.Queue <= 0:
		return bad("Queue", "is not positive")
	case c.ConnectTimeout <= 0 || c.RequestTimeout <= 0:
		return bad("ConnectTimeout/RequestTimeout", "must be positive")
	case c.MaxFrame < wire.HeaderLen+wire.FrameAlign:
		return bad("MaxFrame", "is smaller than a frame")
	case !c.Weights.Valid():
		return bad("Weights", "must be numbers in [0, 1]")
	}
	for _, s := range c.Servers {
		if path, ok := strings.CutPrefix(s, "unix:"); ok && path == "" || s == "" {
			return bad("Servers", fmt.Sprintf("has an empty address %q", s))
		}
	}
	return nil
}
