package scorer

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apiext "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	"k8s.io/apimachinery/pkg/runtime"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
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

// The InferencePool passes GAIE v1.5.0's CustomResourceDefinition as an API server
// admits it: the OpenAPI schema, its CEL rules, and no field the server would prune;
// and each broken variant is refused, naming the field.
func TestTheInferencePoolPassesGAIEsCRD(t *testing.T) {
	crd := inferencePoolCRD(t)
	pool := documents(t, "../../../deploy/kubernetes/inferencepool.yaml")[0]
	if errs := admit(t, crd, pool); len(errs) != 0 {
		t.Fatalf("deploy/kubernetes/inferencepool.yaml: %v", errs)
	}
	for _, tc := range []struct{ name, from, to, field string }{
		{"no ports", "  targetPorts:\n    - number: 8000\n", "  targetPorts: []\n", "spec.targetPorts"},
		{"port 0", "    - number: 8000\n", "    - number: 0\n", "spec.targetPorts[0].number"},
		{"failure mode", "failureMode: FailOpen", "failureMode: Sometimes", "spec.endpointPickerRef.failureMode"},
		{"unknown field", "  selector:\n", "  selectr: {}\n  selector:\n", "spec.selectr"},
		{"duplicate ports", "    - number: 8000\n", "    - number: 8000\n    - number: 8000\n", "spec.targetPorts"},
	} {
		broken := strings.Replace(pool, tc.from, tc.to, 1)
		if broken == pool {
			t.Fatalf("%s: %q is not in the manifest", tc.name, tc.from)
		}
		errs := admit(t, crd, broken)
		if !strings.Contains(strings.Join(errs, "\n"), tc.field) {
			t.Errorf("%s: admitted, or refused without naming %s: %v", tc.name, tc.field, errs)
		}
	}
}

// inferencePoolCRD is the v1 InferencePool's schema from GAIE's module (the pinned
// version's config/crd/bases, which its release manifests are).
func inferencePoolCRD(t *testing.T) *apiext.JSONSchemaProps {
	t.Helper()
	dir, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api-inference-extension").Output()
	if err != nil {
		t.Fatalf("go list -m sigs.k8s.io/gateway-api-inference-extension: %v", err)
	}
	b, err := os.ReadFile(filepath.Join(strings.TrimSpace(string(dir)),
		"config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var crd apiextv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(b, &crd); err != nil {
		t.Fatal(err)
	}
	for _, v := range crd.Spec.Versions {
		if v.Name == "v1" {
			var s apiext.JSONSchemaProps
			if err := apiextv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(v.Schema.OpenAPIV3Schema, &s, nil); err != nil {
				t.Fatal(err)
			}
			return &s
		}
	}
	t.Fatal("GAIE's InferencePool CRD has no v1")
	return nil
}

// admit is what an API server says of manifest under schema: the schema's errors, its
// CEL rules' errors, and the fields it would prune as unknown.
func admit(t *testing.T, schema *apiext.JSONSchemaProps, manifest string) []string {
	t.Helper()
	// As an API server decodes it: integers as int64.
	j, err := yaml.YAMLToJSON([]byte(manifest))
	if err != nil {
		t.Fatal(err)
	}
	var obj map[string]any
	if err := utiljson.Unmarshal(j, &obj); err != nil {
		t.Fatal(err)
	}
	validator, _, err := validation.NewSchemaValidator(schema)
	if err != nil {
		t.Fatal(err)
	}
	structural, err := structuralschema.NewStructural(schema)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range validation.ValidateCustomResource(nil, obj, validator) {
		out = append(out, e.Error())
	}
	rules, _ := cel.NewValidator(structural, true, celconfig.PerCallLimit).
		Validate(context.Background(), nil, structural, obj, nil, celconfig.RuntimeCELCostBudget)
	for _, e := range rules {
		out = append(out, e.Error())
	}
	pruned := runtime.DeepCopyJSON(obj)
	for _, p := range pruning.PruneWithOptions(pruned, structural, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true}) {
		out = append(out, "unknown field "+p)
	}
	return out
}
