package scorer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

var errNoTokenizer = errors.New("no tokenizer sidecar configured")

// tokenize asks the tokenizer sidecar for the request's token ids, as the engine's own
// OpenAI server makes them (its chat template, its tokenizer).
func (s *Scorer) tokenize(ctx context.Context, req *fwksched.LLMRequest) ([]uint32, error) {
	t := s.params.Tokenizer
	if t == nil || req.Body == nil {
		return nil, errNoTokenizer
	}
	body := map[string]any{"model": req.TargetModel}
	switch {
	case req.Body.ChatCompletions != nil:
		body["messages"] = req.Body.ChatCompletions.Messages
		body["add_generation_prompt"] = true
	case req.Body.Completions != nil:
		body["prompt"] = req.Body.Completions.Prompt.PlainText()
	default:
		return nil, errNoTokenizer
	}
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Duration(t.TimeoutMs*float64(time.Millisecond)))
	defer cancel()
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, t.URL, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	r.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", t.URL, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return nil, fmt.Errorf("tokenizer %s: %s: %s", t.URL, resp.Status, msg)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", t.URL, err)
	}
	return out.Tokens, nil
}

// TokenizerFailures counts requests scored without token ids because the tokenizer
// sidecar failed or was late.
func (s *Scorer) TokenizerFailures() uint64 { return s.tokenizerFailures.Load() }
