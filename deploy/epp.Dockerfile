# kvix-epp's image: GAIE v1.5.0's endpoint picker with the kvix-scorer plugin
# (gateway/epp/cmd/kvix-epp), static (no cgo), on distroless. From the repository root:
#   docker build -f deploy/epp.Dockerfile -t kvix-epp:0.1.0 .
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY client/go client/go
COPY gateway/epp gateway/epp
RUN cd gateway/epp && CGO_ENABLED=0 go build -trimpath -o /kvix-epp ./cmd/kvix-epp

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /kvix-epp /kvix-epp
ENTRYPOINT ["/kvix-epp"]
