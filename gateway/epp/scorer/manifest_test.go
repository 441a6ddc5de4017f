package scorer

import (
	"os"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/gateway-api-inference-extension/api/v1"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/config/loader"
	"sigs.k8s.io/yaml"
)

func documents(t *testing.T, path string) []string {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	docs := strings.Split(string(b), "\n---\n")
	for i := range docs[:len(docs)-1] {
		docs[i] += "\n" // the newline the separator took ends the document's last line
	}
	return docs
}

// The ConfigMap the deployed pickers read is the configuration the framework test
// runs, and GAIE's loader takes it.
func TestTheDeployedConfigIsTheTestedOne(t *testing.T) {
	want, err := os.ReadFile("../config/epp-config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, doc := range documents(t, "../../../deploy/kubernetes/epp.yaml") {
		var cm corev1.ConfigMap
		if !strings.Contains(doc, "kind: ConfigMap") {
			continue
		}
		if err := yaml.UnmarshalStrict([]byte(doc), &cm); err != nil {
			t.Fatal(err)
		}
		got := cm.Data["epp-config.yaml"]
		if got != string(want) {
			t.Fatalf("deploy/kubernetes/epp.yaml's ConfigMap is not gateway/epp/config/epp-config.yaml:\n%s", got)
		}
		if _, _, err := loader.LoadRawConfig([]byte(got), logr.Discard()); err != nil {
			t.Fatalf("GAIE's loader refuses the deployed config: %v", err)
		}
		found = true
	}
	if !found {
		t.Fatal("no ConfigMap in deploy/kubernetes/epp.yaml")
	}
}

// The InferencePool is GAIE v1.5.0's type, field for field, and names the picker's Service.
func TestTheInferencePoolIsGAIEsAndPointsAtThePicker(t *testing.T) {
	docs := documents(t, "../../../deploy/kubernetes/inferencepool.yaml")
	if len(docs) != 1 {
		t.Fatalf("%d documents", len(docs))
	}
	var pool v1.InferencePool
	if err := yaml.UnmarshalStrict([]byte(docs[0]), &pool); err != nil {
		t.Fatalf("not an InferencePool of GAIE v1.5.0: %v", err)
	}
	ref := pool.Spec.EndpointPickerRef
	if pool.APIVersion != "inference.networking.k8s.io/v1" || pool.Kind != "InferencePool" ||
		ref.Name != "kvix-epp" || ref.Port == nil || ref.Port.Number != 9002 ||
		ref.FailureMode != v1.EndpointPickerFailOpen || len(pool.Spec.TargetPorts) == 0 {
		t.Fatalf("%+v", pool)
	}
	var svc corev1.Service
	for _, doc := range documents(t, "../../../deploy/kubernetes/epp.yaml") {
		if strings.Contains(doc, "kind: Service\n") {
			if err := yaml.UnmarshalStrict([]byte(doc), &svc); err != nil {
				t.Fatal(err)
			}
		}
	}
	if svc.Name != string(ref.Name) || svc.Spec.Ports[0].Port != int32(ref.Port.Number) {
		t.Fatalf("the pool's picker %s:%d is not the Service %s:%d", ref.Name, ref.Port.Number, svc.Name, svc.Spec.Ports[0].Port)
	}
}
