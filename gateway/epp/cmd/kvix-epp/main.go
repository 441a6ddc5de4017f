// Command kvix-epp is the Gateway API Inference Extension's endpoint picker (v1.5.0)
// with kvix's plugins registered: every in-tree plugin, plus "kvix-scorer" and
// "kvix-openai-parser"; its /metrics carries the scorer's kvix_epp_* series.
// It takes GAIE's own flags (--pool-name, --config-file, ...).
package main

import (
	"os"

	"github.com/kvix/kvix/gateway/epp/scorer"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/gateway-api-inference-extension/cmd/epp/runner"
	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
)

func main() {
	fwkplugin.Register(scorer.Type, scorer.Factory)
	fwkplugin.Register(scorer.ParserType, scorer.ParserFactory)
	if err := runner.NewRunner().WithExecutableName("kvix-epp").WithCustomCollectors(scorer.Collector()).Run(ctrl.SetupSignalHandler()); err != nil {
		os.Exit(1)
	}
}
